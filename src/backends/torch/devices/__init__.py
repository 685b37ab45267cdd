"""What differs per device: cpu, cuda, rocm (and AMD's KFD, GPU visibility), GPU selection, telemetry."""
