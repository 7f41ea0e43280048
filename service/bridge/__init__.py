"""The bridge between the event loop and the engine thread, in rooms.

The engine thread is the only owner of runtime state. The loop talks to it through a
thread-safe inbox of commands (add, abort); the thread drains the inbox between steps,
runs `engine.step()`, and hands each step's outputs back to the loop once per step with
`loop.call_soon_threadsafe`. On the loop, outputs are fanned out to per-request streams.

    loop                          engine thread
    submit() --add-->  inbox  --> drain -> engine.add_request
    abort()  --abort-> inbox  --> drain -> engine.abort_request
    _deliver(outputs) <-- call_soon_threadsafe -- engine.step()

    protocols.py          what the service asks of a model, an engine and a bridge
    commands.py           what the loop sends the engine thread
    engine_thread.py      the one thread that builds the engine and runs it
    streams_in_flight.py  the loop-side table of live streams
    engine_bridge.py      the embedded engine's bridge: the inbox, the thread's loop, delivery
    composition.py        the engine built on its thread, and its bridge on the loop
"""
