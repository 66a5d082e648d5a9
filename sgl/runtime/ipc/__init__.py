"""Messages and sockets between the API process and the worker processes."""
