"""The siblings of SpeCache's low-bit cache: ZipCache's and QuantSpec's quantizers, caches and loops, and the
attention kernel that reads their codes."""
