"""The Trainer integration's rooms, behind the public module txckpt.integrations.transformers.

``mixin`` (TransactionalCheckpointMixin: where each upstream hook is redirected), ``resume`` (what
a resume resolves to, on rank 0), ``remote_cache`` (a remote root's local cache), ``patches`` (the
global patches, each held for one upstream call), ``paths`` (names and path tests), ``verbosity``
(txckpt's records at transformers' verbosity), ``rank_files`` (the files each rank writes itself
and claims) and ``async_saves`` (``txckpt_async_save``). Importing this package imports nothing;
only ``mixin``, ``patches``, ``verbosity`` and ``async_saves`` import transformers or torch. Users
import from txckpt.integrations.transformers; these modules are internal.
"""
