"""Implementation of agentkv's vLLM connector extensions (see ``agentkv.server.engine.connector``).

The pure parts (``_hashing``, ``_leases``, ``_cost``) import nothing from vLLM so they can be unit-tested
without an engine; ``_scheduler`` and ``_worker`` subclass vLLM's NIXL classes and are imported only inside
a vLLM process.
"""
