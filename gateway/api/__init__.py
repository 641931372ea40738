"""The gateway's HTTP endpoints beside the OpenAI API: the admin JSON API."""
