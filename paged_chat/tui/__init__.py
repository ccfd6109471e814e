"""The Textual UI: chat tabs sharing one engine (in a process of its own), and a live view of
the KV cache.

`paged_chat.tui.start.run_app(settings, demo=None)` is what the bare `paged-chat` runs.
"""
