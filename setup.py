from setuptools import find_packages, setup

# Every package under dist_optim/ is found, not listed: a listed set drifts (a wheel once lacked
# dist_optim.shampoo and dist_optim.plan, which the editable install served from the source tree).
# The booster hooks live in the top-level plugins/ folder and install as dist_optim.plugins, never
# as a bare top-level `plugins` package; tests/unit/test_install.py builds the wheel and imports
# every module from it. plugins/startup/ holds only the launcher's sitecustomize.py (package data).
CORE = ["dist_optim", *(f"dist_optim.{name}" for name in find_packages("dist_optim"))]
PLUGINS = ["dist_optim.plugins", *(f"dist_optim.plugins.{name}" for name in find_packages("plugins"))]

setup(
    name="dist_optim",
    version="0.1.0",
    description="Memory-efficient and second-order optimizers that are exact under tensor parallelism and ZeRO",
    python_requires=">=3.10",
    packages=CORE + PLUGINS,
    package_dir={"dist_optim": "dist_optim", "dist_optim.plugins": "plugins"},
    # The launcher's start-up hook: a folder of its own (no package), put first on PYTHONPATH.
    package_data={"dist_optim.plugins": ["startup/sitecustomize.py"]},
    # The core reads a tensor's TP split through registered readers only; the ColossalAI
    # integration registers its reader when this module loads (dist_optim.layout.read_tp_dim).
    entry_points={"dist_optim.integrations": ["colossalai = dist_optim.plugins.colossal"]},
    install_requires=["torch>=2.2"],
    extras_require={"colossalai": ["colossalai==0.5.0"]},
)
