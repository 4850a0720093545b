"""KV memory: the token-granular pool (``kv_pool``) and the request->slot table (``req_table``).
[2/9] adds the radix tree and the cache manager that owns both."""
