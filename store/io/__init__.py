"""The only code that talks to Redis: clients from URLs, and the executors of operations."""
