"""A tiered root: saves commit on a fast local tier and are replicated to a durable tier.

Internal. Importing this package imports nothing.
"""
