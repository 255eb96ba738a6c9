"""What a run says about itself: the per-step line and its records (`reporting`), where metrics go (`metric_sinks`:
JSONL, TensorBoard, Weights & Biases) and the run's summary and chart (`run_report`)."""
