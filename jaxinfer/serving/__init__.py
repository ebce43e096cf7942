"""gRPC serving: ``jaxinfer.proto`` (package ``jaxinfer.v1``), its committed stubs, the
servicer, the engine thread, metrics and a client.

Modules: ``server`` (InferenceServer, ``jaxinfer serve``), ``servicer`` (RPCs),
``engine_thread`` (the engine loop in its own thread), ``protocol`` (messages <-> engine
objects), ``metrics`` (Prometheus), ``client`` (InferenceClient), ``codegen`` (regenerates the
stubs), ``cli`` (the subcommands).
"""

DEFAULT_PORT = 50051  # gRPC port of `jaxinfer serve` unless --port says otherwise
