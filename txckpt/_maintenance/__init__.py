"""Maintenance: reader leases, intent records and the reclaim of dead writers' staging, retention, and garbage collection.

Internal. Importing this package imports nothing.
"""
