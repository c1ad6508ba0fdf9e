"""The server: an OpenAI-compatible HTTP API with a step stream, and a web page that shows the canvas forming.

- `app.py`: the HTTP layer (FastAPI); it never touches tensors.
- `scheduler.py`: owns batching; the HTTP layer submits requests to it and reads their events.
- `protocol.py`: the request/response models; `chat.py`: messages -> prompt; `output.py`: output text cuts.
- `command.py`: `printpress serve`; `static/`: the page.

Importing this package imports nothing heavy; FastAPI is imported by `app.py` only.
"""
