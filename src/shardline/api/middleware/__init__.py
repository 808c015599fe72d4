"""The ASGI layers a request passes before its route: body limit, Host check, API key, Ollama's door."""
