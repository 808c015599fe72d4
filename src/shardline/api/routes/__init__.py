"""One module per API's routes (openai, anthropic, ollama, cluster) and the dashboard's files."""
