"""Seeded task meta-distributions: each draws a fresh task, and a task draws (support, target) point sets.

A *meta-distribution* is a law over tasks; a *task* is a law over points in ``R^d``. Training and evaluation draw
the support ``S`` (``m`` points) and the target (``n`` points) independently from the same task (paper §A.4: the
target is not the support), except for data-set tasks, whose evaluation reference is the rest of the class.

Every sampler takes an explicit :class:`torch.Generator`; nothing touches the global random state, so a seed
fixes the whole stream. The task generators of the paper's release are missing (paper §A.2, §D.5): each class
docstring says which parameters are the paper's ([PAPER]/[CODE]) and which are this project's choice ([ASSUMED]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "DigitsTasks",
    "GaussianMixtureTasks",
    "MetaDistribution",
    "Mixed2DTasks",
    "PCAFeatureTasks",
    "ShellTasks",
    "Task",
    "TaskBatch",
    "make_meta",
]


@dataclass
class TaskBatch:
    """A batch of tasks.

    Attributes:
        support: support sets, shape ``(B, m, d)``.
        target: target (or reference) points of the same tasks, shape ``(B, n, d)``.
    """

    support: torch.Tensor
    target: torch.Tensor

    def to(self, device: str | torch.device) -> TaskBatch:
        """The same tasks on ``device``."""
        return TaskBatch(self.support.to(device), self.target.to(device))


class Task:
    """One task: a law over points. Subclasses implement :meth:`sample`; :meth:`split` draws support and target."""

    dim: int

    def sample(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """``n`` i.i.d. points of the task, shape ``(n, d)``, float32."""
        raise NotImplementedError

    def split(self, m: int, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Support ``(m, d)`` and target ``(n, d)``, drawn independently from the task."""
        return self.sample(m, generator), self.sample(n, generator)

    def eval_split(self, m: int, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Support ``(m, d)`` and evaluation reference ``(n, d)``; for laws, the same as :meth:`split`."""
        return self.split(m, n, generator)


class MetaDistribution:
    """A seeded law over tasks of dimension ``dim``. Subclasses implement :meth:`sample_task`."""

    dim: int
    name: str = "meta"

    def sample_task(self, generator: torch.Generator, split: str = "train") -> Task:
        """A fresh task. ``split`` is ``"train"`` or ``"test"``; data-set tasks use disjoint classes per split."""
        raise NotImplementedError

    def spec(self) -> dict:
        """The scalar parameters of this meta-distribution (they identify trained models in caches)."""
        return {"name": self.name, **{k: v for k, v in vars(self).items() if isinstance(v, int | float | str | bool)}}

    def sample_batch(
        self, n_tasks: int, m: int, n: int, generator: torch.Generator, split: str = "train"
    ) -> TaskBatch:
        """``n_tasks`` fresh tasks with ``m`` support and ``n`` target points each.

        Returns:
            :class:`TaskBatch` with support ``(n_tasks, m, d)`` and target ``(n_tasks, n, d)``.
        """
        supports, targets = [], []
        for _ in range(n_tasks):
            s, x = self.sample_task(generator, split).split(m, n, generator)
            supports.append(s)
            targets.append(x)
        return TaskBatch(torch.stack(supports), torch.stack(targets))


def _check_dim(dim: int, low: int = 1, high: int = 256) -> int:
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"expected an integer dimension d, got {type(dim).__name__}")
    if not low <= dim <= high:
        raise ValueError(f"expected a dimension d in [{low}, {high}], got {dim}; pick d in that range")
    return dim


def _randint(low: int, high: int, generator: torch.Generator) -> int:
    """An integer uniform on ``{low, ..., high}`` (both included)."""
    return int(torch.randint(low, high + 1, (), generator=generator))


def _uniform(shape: tuple[int, ...] | int, low: float, high: float, generator: torch.Generator) -> torch.Tensor:
    shape = (shape,) if isinstance(shape, int) else shape
    return low + (high - low) * torch.rand(shape, generator=generator)


def random_rotation(d: int, generator: torch.Generator) -> torch.Tensor:
    """A Haar-random orthogonal matrix ``(d, d)`` (QR of a Gaussian matrix, column signs fixed)."""
    q, r = torch.linalg.qr(torch.randn(d, d, generator=generator, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r)).unsqueeze(0)).float()


class _MixtureTask(Task):
    """Equal-weight Gaussian mixture with means ``(K, d)`` and covariance factors ``(K, d, d)`` (x = mu + L z)."""

    def __init__(self, means: torch.Tensor, factors: torch.Tensor):
        self.means, self.factors, self.dim = means, factors, means.shape[-1]

    def sample(self, n: int, generator: torch.Generator) -> torch.Tensor:
        k = torch.randint(0, self.means.shape[0], (n,), generator=generator)
        z = torch.randn(n, self.dim, generator=generator)
        return self.means[k] + (self.factors[k] @ z.unsqueeze(-1)).squeeze(-1)


class GaussianMixtureTasks(MetaDistribution):
    """Gaussian mixtures in ``R^d`` (paper §D.1, the ``gaussian_mixture`` meta-distribution).

    A task has ``K ~ U{k_min..k_max}`` components of weight ``1/K``, means ``mu_k ~ N(0, mean_scale^2 I)`` and
    anisotropic covariances ``Sigma_k = Q_k diag(U(std_low, std_high)^2) Q_k^T`` with ``Q_k`` a random rotation.

    Paper's parameters [PAPER/CODE meta_params]: ``K ~ U{2..8}``, equal weights, ``mean_scale = 5``,
    ``cov_scale = 1``. Assumed [ASSUMED, §D.1]: the covariance form (random rotation times per-axis standard
    deviations ``U(0.3, 1.0)``). With these, the NW ``n_eff`` at ``t = 0.56`` is about 8 at ``d = 2`` and about 2
    at ``d = 16`` (the paper reports about 9 and about 1). ``dim`` is in ``[1, 256]``.
    """

    name = "gmm"

    def __init__(
        self,
        dim: int,
        k_min: int = 2,
        k_max: int = 8,
        mean_scale: float = 5.0,
        std_low: float = 0.3,
        std_high: float = 1.0,
    ):
        self.dim = _check_dim(dim)
        if not 1 <= k_min <= k_max:
            raise ValueError(f"expected 1 <= k_min <= k_max, got k_min={k_min}, k_max={k_max}")
        if not 0 < std_low <= std_high:
            raise ValueError(f"expected 0 < std_low <= std_high, got {std_low}, {std_high}")
        self.k_min, self.k_max, self.mean_scale = k_min, k_max, mean_scale
        self.std_low, self.std_high = std_low, std_high

    def sample_task(self, generator: torch.Generator, split: str = "train") -> Task:
        k = _randint(self.k_min, self.k_max, generator)
        means = self.mean_scale * torch.randn(k, self.dim, generator=generator)
        factors = torch.stack(
            [
                random_rotation(self.dim, generator) * _uniform(self.dim, self.std_low, self.std_high, generator)
                for _ in range(k)
            ]
        )  # (K, d, d): Q diag(s), so L L^T = Q diag(s^2) Q^T
        return _MixtureTask(means, factors)


class _Shape2DTask(Task):
    """A 2-D shape (ring, moons, spiral) drawn by a parametric sampler, then rotated, scaled and shifted."""

    dim = 2

    def __init__(self, kind: str, params: dict, rotation: torch.Tensor, scale: float, shift: torch.Tensor):
        self.kind, self.params, self.rotation, self.scale, self.shift = kind, params, rotation, scale, shift

    def _raw(self, n: int, g: torch.Generator) -> torch.Tensor:
        p = self.params
        if self.kind == "rings":
            radii = torch.tensor(p["radii"])
            r = radii[torch.randint(0, len(radii), (n,), generator=g)]
            angle = 2 * math.pi * torch.rand(n, generator=g)
            x = r.unsqueeze(-1) * torch.stack([angle.cos(), angle.sin()], -1)
        elif self.kind == "moons":
            upper = torch.rand(n, generator=g) < 0.5
            angle = math.pi * torch.rand(n, generator=g)
            top = torch.stack([angle.cos(), angle.sin()], -1)
            bottom = torch.stack([1 - angle.cos(), 0.5 - angle.sin()], -1)
            x = torch.where(upper.unsqueeze(-1), top, bottom) - torch.tensor([0.5, 0.25])
        elif self.kind == "spirals":
            arms = p["arms"]
            arm = torch.randint(0, arms, (n,), generator=g)
            s = torch.rand(n, generator=g).sqrt()
            angle = p["turns"] * 2 * math.pi * s + 2 * math.pi * arm / arms
            x = s.unsqueeze(-1) * torch.stack([angle.cos(), angle.sin()], -1)
        else:  # pragma: no cover - kinds are fixed by Mixed2DTasks
            raise ValueError(f"unknown 2-D shape {self.kind!r}")
        return x + p["noise"] * torch.randn(n, 2, generator=g)

    def sample(self, n: int, generator: torch.Generator) -> torch.Tensor:
        return self.scale * self._raw(n, generator) @ self.rotation.T + self.shift


class Mixed2DTasks(MetaDistribution):
    """The 2-D mixed family: Gaussian mixtures, concentric rings, two moons and spirals (paper §A.5, ``mixed``).

    Each task picks a family uniformly, then its own parameters; every shape is randomly rotated, scaled by
    ``U(2, 5)`` and shifted by ``N(0, 1)``, so all families live on the GMM's length scale.

    Paper's parameters [PAPER]: the four families, ``d = 2``, the GMM part as in :class:`GaussianMixtureTasks`.
    Assumed [ASSUMED, the generator is not released]: equal family probabilities; rings with 1–3 radii in
    ``U(0.3, 1)``; moons of radius 1; spirals with 1–3 arms and 0.5–1.5 turns; point noise ``U(0.02, 0.08)`` on the
    unit scale; the rotation, scale and shift ranges.
    """

    name = "mixed2d"
    dim = 2
    kinds = ("gmm", "rings", "moons", "spirals")

    def __init__(self):
        self._gmm = GaussianMixtureTasks(2)

    def sample_task(self, generator: torch.Generator, split: str = "train") -> Task:
        kind = self.kinds[_randint(0, len(self.kinds) - 1, generator)]
        if kind == "gmm":
            return self._gmm.sample_task(generator, split)
        params = {"noise": float(_uniform(1, 0.02, 0.08, generator))}
        if kind == "rings":
            params["radii"] = _uniform(_randint(1, 3, generator), 0.3, 1.0, generator).tolist()
        elif kind == "spirals":
            params["arms"] = _randint(1, 3, generator)
            params["turns"] = float(_uniform(1, 0.5, 1.5, generator))
        return _Shape2DTask(
            kind,
            params,
            rotation=random_rotation(2, generator),
            scale=float(_uniform(1, 2.0, 5.0, generator)),
            shift=torch.randn(2, generator=generator),
        )


class _ShellTask(Task):
    def __init__(self, radii: torch.Tensor, noise: float, dim: int):
        self.radii, self.noise, self.dim = radii, noise, dim

    def sample(self, n: int, generator: torch.Generator) -> torch.Tensor:
        r = self.radii[torch.randint(0, len(self.radii), (n,), generator=generator)]
        u = torch.randn(n, self.dim, generator=generator)
        u = u / u.norm(dim=-1, keepdim=True)  # uniform on the sphere S^{d-1}
        return (r + self.noise * torch.randn(n, generator=generator)).unsqueeze(-1) * u


class ShellTasks(MetaDistribution):
    """Concentric spherical shells centred at 0 (paper §D.2, ``a3_shells``).

    A task has ``K ~ U{k_min..k_max}`` shells of equal weight, radii ``r_k = radius_scale * U(0.2, 1.0)``, and
    points ``x = (r_k + noise_scale * eps) u`` with ``u`` uniform on the sphere and ``eps ~ N(0, 1)``.

    Paper's parameters [CODE meta_params]: ``min_shells = 2``, ``max_shells = 5``, ``radius_scale = 5.0``,
    ``noise_scale = 0.3``. Assumed [ASSUMED]: the radius law ``U(0.2, 1.0)``, equal weights, the centre at 0.

    Args:
        dim: dimension ``d`` in ``[2, 256]``.
    """

    name = "shells"

    def __init__(self, dim: int, k_min: int = 2, k_max: int = 5, radius_scale: float = 5.0, noise_scale: float = 0.3):
        self.dim = _check_dim(dim, low=2)
        if not 1 <= k_min <= k_max:
            raise ValueError(f"expected 1 <= k_min <= k_max, got k_min={k_min}, k_max={k_max}")
        self.k_min, self.k_max, self.radius_scale, self.noise_scale = k_min, k_max, radius_scale, noise_scale

    def sample_task(self, generator: torch.Generator, split: str = "train") -> Task:
        k = _randint(self.k_min, self.k_max, generator)
        radii = self.radius_scale * _uniform(k, 0.2, 1.0, generator)
        return _ShellTask(radii, self.noise_scale, self.dim)


class _GaussianTask(Task):
    def __init__(self, mean: torch.Tensor, factor: torch.Tensor):
        self.mean, self.factor, self.dim = mean, factor, mean.shape[-1]

    def sample(self, n: int, generator: torch.Generator) -> torch.Tensor:
        return self.mean + torch.randn(n, self.dim, generator=generator) @ self.factor.T


class PCAFeatureTasks(MetaDistribution):
    """Synthetic "PCA-feature" classes, the offline stand-in for DINOv2-ImageNet features (paper §D.3 (i)).

    Per dimension ``j = 1..d`` a between-class fraction ``b_j = between * j^(-1/2)`` (leading components carry more
    class information) and unit total variance. A task (class) has mean ``mu ~ N(0, diag(b))`` and within-class law
    ``N(mu, R diag(1 - b) R^T)`` with ``R = expm(rotation * A)``, ``A`` a random skew-symmetric matrix.
    Training and test tasks come from disjoint seed streams (each task is a new class); the ``split`` argument is
    accepted for symmetry with :class:`DigitsTasks`.

    Paper's parameters [PAPER]: ``d = 16`` (PCA-16 standardised features), tasks = classes. Everything else is
    [ASSUMED]: ``between = 0.7``, ``rotation = 0.3``, the Gaussian within-class law.

    Args:
        dim: dimension ``d`` in ``[1, 256]``.
    """

    name = "pcafeat"

    def __init__(self, dim: int = 16, between: float = 0.7, rotation: float = 0.3):
        self.dim = _check_dim(dim)
        if not 0 < between < 1:
            raise ValueError(f"expected a between-class fraction in (0, 1), got {between}")
        self.between, self.rotation = between, rotation
        self.b = between * torch.arange(1, self.dim + 1, dtype=torch.float32).pow(-0.5)  # (d,)

    def sample_task(self, generator: torch.Generator, split: str = "train") -> Task:
        mean = self.b.sqrt() * torch.randn(self.dim, generator=generator)
        a = torch.randn(self.dim, self.dim, generator=generator, dtype=torch.float64)
        rot = torch.linalg.matrix_exp(self.rotation * (a - a.T) / math.sqrt(2 * self.dim)).float()
        return _GaussianTask(mean, rot * (1 - self.b).sqrt())  # (d, d): R diag(sqrt(1 - b))


class _PoolTask(Task):
    """A finite pool of points (one class of a data set)."""

    def __init__(self, points: torch.Tensor):
        self.points, self.dim = points, points.shape[-1]

    def sample(self, n: int, generator: torch.Generator) -> torch.Tensor:
        return self.points[torch.randint(0, len(self.points), (n,), generator=generator)]

    def split(self, m: int, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Support: ``m`` distinct points; target: ``n`` draws (with replacement) from the rest of the class."""
        if m >= len(self.points):
            raise ValueError(f"expected a support size below the class size {len(self.points)}, got m={m}")
        order = torch.randperm(len(self.points), generator=generator)
        rest = self.points[order[m:]]
        return self.points[order[:m]], rest[torch.randint(0, len(rest), (n,), generator=generator)]

    def eval_split(self, m: int, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Support: ``m`` distinct points; reference: up to ``n`` other distinct points of the class (§D.3 (ii))."""
        if m >= len(self.points):
            raise ValueError(f"expected a support size below the class size {len(self.points)}, got m={m}")
        order = torch.randperm(len(self.points), generator=generator)
        return self.points[order[:m]], self.points[order[m : m + n]]


class DigitsTasks(MetaDistribution):
    """Classes of scikit-learn's ``load_digits`` (8×8 images, ships with scikit-learn) as tasks (paper §D.3 (ii)).

    Images are reduced by a PCA fitted on the training classes only, and each component is standardised with the
    training classes' mean and standard deviation. A training task is a random training class; a test task a
    random test class; the two sets of classes are disjoint. Support and target are disjoint draws from the class.

    Paper's parameters [CODE encode/whiten scripts]: PCA fitted on training classes, per-component standardisation,
    the first ``d`` components, classes as tasks, disjoint class splits. Assumed [ASSUMED]: the data set itself
    (the paper used DINOv2-ImageNet, which needs a hub download), training classes ``0..6`` and test classes
    ``7..9``, training tasks augmented by random subsets and random rotations.

    ``dim``: PCA components, in ``[1, 64]``; ``augment``: rotate every training task by a random orthogonal matrix.
    """

    name = "digits"

    def __init__(self, dim: int = 16, train_classes: tuple[int, ...] = (0, 1, 2, 3, 4, 5, 6), augment: bool = True):
        from sklearn.datasets import load_digits
        from sklearn.decomposition import PCA

        self.dim = _check_dim(dim, high=64)
        self.augment = augment
        data = load_digits()
        x, y = data.data, data.target
        train = set(train_classes)
        test_classes = sorted(set(range(10)) - train)
        if not train or not test_classes:
            raise ValueError(f"expected train classes a proper subset of 0..9, got {train_classes}")
        is_train = torch.tensor([int(c) in train for c in y])
        pca = PCA(n_components=self.dim, random_state=0).fit(x[is_train.numpy()])
        z = torch.from_numpy(pca.transform(x)).float()
        mean, std = z[is_train].mean(0), z[is_train].std(0)
        z = (z - mean) / std
        labels = torch.from_numpy(y)
        self.classes = {"train": sorted(train), "test": test_classes}
        self.pools = {int(c): z[labels == c] for c in range(10)}
        self.explained_variance_ratio = torch.from_numpy(pca.explained_variance_ratio_).float()

    def sample_task(self, generator: torch.Generator, split: str = "train") -> Task:
        if split not in self.classes:
            raise ValueError(f"expected split 'train' or 'test', got {split!r}")
        classes = self.classes[split]
        points = self.pools[classes[_randint(0, len(classes) - 1, generator)]]
        if self.augment and split == "train":
            points = points @ random_rotation(self.dim, generator).T  # (n_class, d): a rotated copy of the class
        return _PoolTask(points)


#: meta-distribution names accepted by :func:`make_meta`.
META_NAMES = ("gmm", "mixed2d", "shells", "pcafeat", "digits")


def make_meta(name: str, dim: int) -> MetaDistribution:
    """The meta-distribution ``name`` (one of :data:`META_NAMES`) in dimension ``dim``."""
    if name == "gmm":
        return GaussianMixtureTasks(dim)
    if name == "mixed2d":
        if dim != 2:
            raise ValueError(f"expected d = 2 for the mixed 2-D family, got {dim}")
        return Mixed2DTasks()
    if name == "shells":
        return ShellTasks(dim)
    if name == "pcafeat":
        return PCAFeatureTasks(dim)
    if name == "digits":
        return DigitsTasks(dim)
    raise ValueError(f"expected a meta-distribution in {META_NAMES}, got {name!r}")
