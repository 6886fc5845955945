"""The size limits of a request, the same at every HTTP edge (the router checks them
before any bookkeeping, the scheduler before any work): a request that passes one edge
is never refused by the next for its size, and none costs an edge more than these."""

MAX_BODY = 8 * 1024 * 1024  # bytes of one request body
MAX_BATCH = 64  # items of one batch /generate; each is a request, counted against the queue
MAX_CHOICES = 16  # samples of one prompt (OpenAI's and SGLang's n); each is a request
MAX_RID = 256  # characters of one request id
MAX_CACHE_SALT = 256  # characters of one cache_salt (shared/messages/cache.py)
MAX_RETENTION_PRIORITY = 9  # a retention hint's highest priority (docs/tiers.md)
