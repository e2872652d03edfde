"""torch DCP's integration rooms behind the public module txckpt.integrations.dcp: compatibility across torch versions, incremental items, ranged reads.

Internal. Importing this package imports nothing.
"""
