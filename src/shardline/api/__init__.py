"""The HTTP APIs every node serves: OpenAI, Anthropic and Ollama routes, cluster routes, the dashboard."""
