"""Loading a checkpoint: its stored bytes, the released DeepSeek-V4 layout, and streamed device placement."""
