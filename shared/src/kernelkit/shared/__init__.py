"""kernelkit-shared: runtime glue for kernelkit ops and the toolkit their tests and benchmarks use.

Runtime modules (`runtime`, `layout`) import only torch and triton. `testing`, `bench`, `report`
and `pytest_plugin` serve tests and benchmarks and are never imported by an op at run time.
"""

__version__ = "0.2.16"
