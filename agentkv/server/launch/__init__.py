"""Starting engines and routers: `agentkv up` / `down` (`_cluster`), one engine's vLLM command line
(`_launcher`), the demo's tiny model (`_model`), NIXL warm-up (`_warmup`) and the installed engine's version
checks (`_versions`)."""
