"""Training: batches (`printpress.train.data`), objectives and the training loop.

Kept free of imports so that `import printpress.train.data` does not pull in the loop (and
its optional dependencies) and the submodules can be written and tested separately.
"""
