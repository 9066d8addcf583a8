"""agentkv's server side, in three roles:

- `agentkv.server.router`: the OpenAI-compatible router (an ASGI app) in front of prefill and decode engines;
- `agentkv.server.engine`: code that runs inside vLLM's processes (the KV connector and the API-server
plugin);
- `agentkv.server.launch`: starting engines and routers (`agentkv up`, `agentkv serve`), the tiny model,
warm-up
  and version checks.

The router never imports the engine or launch packages, nor they the router's internals.
"""
