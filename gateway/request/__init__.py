"""One proxied request: its facts, the attempts (choose, send, retry, queue), the relay of a stream and its continuation elsewhere, stored Responses."""
