"""Reading input files on the workers: each kind of file into raw records (readers), compressed files strictly (compressed)."""
