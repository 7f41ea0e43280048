"""Past one machine: pagedserve workers behind NVIDIA Dynamo's KV-aware router.

    worker.py         `pagedserve worker`: the engine (same engine thread) as a Dynamo endpoint;
                      publishes KV events and load
    front_door.py     `pagedserve serve --router dynamo`: DynamoBridge, the EngineBridge interface
                      over Dynamo's router, and RemoteModel, the loop-side model facts
    wire.py           what crosses the request plane (msgspec Structs as plain dicts)
    dynamo_runtime.py the Dynamo runtime on one host or many (file discovery, TCP, ZMQ)
    kv_publisher.py   engine KV events -> Dynamo's KvEventPublisher
    vllm_events.py    engine KV events -> vLLM's ZMQ wire format (for llm-d / Gateway API EPP)

Everything here imports `dynamo` (the optional extra `pagedserve[dynamo]`) lazily: the
embedded server never needs it.
"""
