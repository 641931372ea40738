"""The engines as the gateway reaches them: the pooled HTTP/1.1 client, its errors translated, what a worker's record says its engine can do."""
