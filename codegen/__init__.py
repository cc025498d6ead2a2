"""What to compute: operators as TVM tensor expressions over ``Layout`` index maps, and the
ahead-of-time build driver that turns a spec into a compiled library and its manifest."""
