"""The OpenAI Realtime API over a WebSocket (`/v1/realtime?model=...`), as the openai SDK's
`client.realtime.connect()` speaks it.

One module per job: `limits` (the per-connection bounds), `events` (client events checked, server events
built, errors as `error` events), `session` (the session's configuration), `items` (the conversation, as
turns for a request), `audio_buffer` (the input audio not yet committed), `vad` (server turn detection),
`runner` (one response: one GenerateRequest down the request path, its events as server events) and
`endpoint` (the WebSocket: read, dispatch, send). Each response runs through the HTTP door's Call, so
admission, cancellation, metrics and traces are those of every other request.
"""

from .endpoint import RealtimeEndpoint

__all__ = ["RealtimeEndpoint"]
