"""Checkpoint files, shared by the shard servers (which write and read their
shard files) and the clients (which commit a checkpoint with its manifest):
`manifest` (MANIFEST.json, save ids, which files a save supersedes, the
links of a chain), `shard_files` (one shard's HDF5 file: save, and apply a
full checkpoint or a delta for a load), `verified` (reading a file so what is
parsed is what was verified) and `chain` (chains as a whole: list, retain,
compact). Imports no TensorFlow and nothing of the server process."""
