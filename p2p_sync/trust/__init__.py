"""Trust: keys, signed manifests and announcements, the one trusted gate, chunk checks. I/O-free."""
