"""The bridge between the event loop and the engine thread, in rooms.

The engine thread is the only owner of runtime state; the loop reaches it through a bridge
(engine_bridge.py draws the hand-off). The rooms:

    protocols.py          what the service asks of a model, an engine and a bridge
    commands.py           what the loop sends the engine thread
    engine_thread.py      the one thread that builds the engine and runs it
    streams_in_flight.py  the loop-side table of live streams
    engine_bridge.py      the embedded engine's bridge: the inbox, the thread's loop, delivery
    composition.py        the engine built on its thread, and its bridge on the loop
"""
