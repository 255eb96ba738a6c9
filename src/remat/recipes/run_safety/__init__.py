"""What keeps a run safe to start, stop, resume and share: the run lock (`run_lock`), the paths a run writes and the
links it refuses (`output_paths`), what a resume does with a changed recipe (`resume_rules`, `resume_changes`) and
the numerics guard that never applies a non-finite update (`numerics`)."""
