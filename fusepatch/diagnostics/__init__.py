"""What a profiled step shows: aten ops vs GPU kernels, GPU busy, MFU; Triton builds."""
