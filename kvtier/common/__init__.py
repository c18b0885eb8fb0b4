"""What the scheduler side, the worker side and the I/O process share: the configuration,
block keys and namespaces, the KV layout, the stored entry's header, the host pool's slots,
and the plans that cross from the scheduler to the worker."""
