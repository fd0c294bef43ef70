"""fusepatch's own Triton kernels: small, fixed-configuration kernels where an upstream one costs more to get
ready (autotuning) than it saves, or is missing. Imported only after the ``triton`` requirement passed."""
