"""What the gateway tells: Prometheus series (the request path's as cells), the summary line of a request, tracing."""
