"""The `txckpt` command's implementation: the parser, common formatting, one module per group of commands.

Internal: the public entry point is `txckpt.cli`. Importing this package imports nothing.
"""
