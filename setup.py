from setuptools import setup

setup(
    name="dist_optim",
    version="0.1.0",
    description="Memory-efficient and second-order optimizers that are exact under tensor parallelism and ZeRO",
    python_requires=">=3.10",
    # The booster hooks live in the top-level plugins/ folder and install as dist_optim.plugins,
    # never as a bare top-level `plugins` package.
    packages=["dist_optim", "dist_optim.plugins"],
    package_dir={"dist_optim": "dist_optim", "dist_optim.plugins": "plugins"},
    install_requires=["torch>=2.2"],
    extras_require={"colossalai": ["colossalai==0.5.0"]},
)
