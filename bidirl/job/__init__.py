"""What a user describes: the job config (``config``), the shipped presets (``presets``) and the static
partition planner, Algorithm 1 of paper §4 (``planner``)."""
