"""The gateway's HTTP endpoints beside the OpenAI API: the admin JSON API, the scaling signal, the dashboard, and the OpenAPI document they are described by."""
