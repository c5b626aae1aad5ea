"""Data movement kernels, one module each: ``pull_tokens``, ``combine``, ``publish_ids``,
``offset_copy``, ``regather_rows``, ``route_grad``, ``call_counters``, ``slot_cursor``,
``local_routes`` (the collective transports' step 2), and the
rowwise API's ``rowwise_put`` and ``rowwise_get`` (:mod:`distmoe.rowwise`)."""
