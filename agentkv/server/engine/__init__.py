"""Code that vLLM loads into its own processes.

- `agentkv.server.engine.connector`: the KV connector (`kv_connector_module_path`), built in `_connector/`;
- `agentkv.server.engine.plugin`: the API-server plugin (entry point `vllm.general_plugins`);
- `agentkv.server.engine.internals`: every vLLM internal the two wrap or replace, with the releases each was
  checked against.

Nothing here is imported by the router.
"""
