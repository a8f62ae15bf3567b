"""What a run shows while it runs: metrics, the step log, the summary, throughput, the peak, collective bytes, watchdog."""
