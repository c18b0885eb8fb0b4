"""Worker side: the host pool's memory and the copies between it and the device."""
