"""What each device runs: attention implementation, default dtype, batch sizes, kernel fit."""
