"""coda's kernels: quack's SM90 mainloop + an epilogue program + its AUX reductions,
one family per file (see each file's docstring)."""
