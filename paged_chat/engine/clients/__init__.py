"""The client layer: how the app reaches an engine.

    client_protocol.py   EngineClient, ClientCapabilities (with core/outputs.py's ModelInfo):
                         all a front end may use
    factory.py           ClientSpec, make_client and start_client: the one way to get a client
    local.py             LocalClient: streams and the output processor over a transport
    thread_transport.py  the Engine on a thread of this process
    process_transport.py the Engine in a spawned child process, over a pipe
    engine_loop.py       the loop either transport runs the Engine in, and its commands
    streams.py           the asyncio side: one queue per open request
    remote.py            RemoteClient: an OpenAI-compatible server over HTTP

Nothing is imported here, so reading the protocol does not load torch.
"""
