"""What travels between the job's steps: plain-tuple records (records) and columnar token batches (columns)."""
