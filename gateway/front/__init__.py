"""The front: the client's connection (uvicorn's httptools protocol, the compiled hooks), the fast path that answers a proxied request onto it, the connection limits, the serving processes."""
