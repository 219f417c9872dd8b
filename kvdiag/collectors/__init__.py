"""What observes a live process: engine adapters, allocator, release paths, NVML, /proc, py-spy."""
