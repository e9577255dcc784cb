"""Stand-ins for the CUDA libraries of PyPI's aarch64 torch wheel, so that
``import torch`` works on an emulated aarch64 CPU (``make arm-check``).

PyPI's torch for aarch64 Linux is a CUDA build: even libtorch_cpu.so
lists libcudart and libcupti as needed libraries, and the CUDA wheels it
requires (several GB) are of no use without a GPU. The loader binds
function symbols lazily, so torch loads against small libraries of the
same names (and symbol versions) that define every symbol torch takes from
them; each such function returns 100 (cudaErrorNoDevice) and is never
reached on the CPU path: torch asks cudaGetDeviceCount first, which then
reports no device, so ``torch.cuda.is_available()`` is False.

Usage: python arm_cuda_stubs.py TORCH_LIB_DIR SYSROOT OUT_DIR
(host Python; needs aarch64-linux-gnu-gcc and -readelf).
"""
import collections
import glob
import os
import re
import subprocess
import sys

READELF = 'aarch64-linux-gnu-readelf'
CC = 'aarch64-linux-gnu-gcc'


def readelf(*args):
    return subprocess.run([READELF, '-W', *args], check=True,
                          capture_output=True, text=True).stdout


def needed(lib):
    return re.findall(r'\(NEEDED\)\s+Shared library: \[(.+?)\]',
                      readelf('-d', lib))


def version_files(lib):
    """{version name: library file} from the object's version needs."""
    files, current = {}, None
    for line in readelf('-V', lib).splitlines():
        m = re.search(r'File: (\S+)', line)
        if m:
            current = m.group(1)
        m = re.search(r'Name: (\S+)\s+Flags', line)
        if m and current:
            files[m.group(1)] = current
    return files


def undefined(lib):
    """(symbol, version or None, is_object) of the undefined symbols."""
    out = []
    for line in readelf('--dyn-syms', lib).splitlines():
        f = line.split()
        if len(f) >= 8 and f[6] == 'UND' and f[4] != 'WEAK':
            name, _, version = f[7].partition('@')
            out.append((name, version.split(' ')[0] or None,
                        f[3] == 'OBJECT'))
    return out


def is_elf(path):
    if os.path.islink(path) or not os.path.isfile(path):
        return False
    with open(path, 'rb') as f:
        return f.read(4) == b'\x7fELF'


def defined(libs):
    names = set()
    for lib in libs:
        for line in readelf('--dyn-syms', lib).splitlines():
            f = line.split()
            if len(f) >= 8 and f[6] != 'UND':
                names.add(f[7].split('@')[0])
    return names


def main(torch_lib, sysroot, out_dir):
    libs = sorted(glob.glob(os.path.join(torch_lib, '*.so*')))
    present = {os.path.basename(p) for p in libs}
    present |= {os.path.basename(p) for p in glob.glob(
        os.path.join(sysroot, '**', '*.so*'), recursive=True)}
    missing = sorted({n for lib in libs for n in needed(lib)} - present)
    if not missing:
        return
    # file -> version -> {name: is_object}
    symbols = collections.defaultdict(lambda: collections.defaultdict(dict))
    loose = {}
    for lib in libs:
        files = version_files(lib)
        for version, file in files.items():
            if file in missing:
                symbols[file][version].update()  # the version must exist
        for name, version, is_object in undefined(lib):
            if version in files and files[version] in missing:
                symbols[files[version]][version][name] = is_object
            elif version is None:
                loose[name] = is_object
    # Unversioned symbols that neither the interpreter (which exports
    # Python's C API) nor a present library defines go to the first stub.
    system = [p for p in glob.glob(os.path.join(sysroot, '**', '*.so*'),
                                   recursive=True) if is_elf(p)]
    interpreter = os.path.join(sysroot, 'usr', 'bin', 'python3.11')
    known = defined(libs + system + [interpreter])
    first = symbols[missing[0]]
    first[next(iter(first), missing[0])].update(
        {n: o for n, o in loose.items() if n not in known})
    os.makedirs(out_dir, exist_ok=True)
    for soname in missing:
        build_stub(soname, symbols[soname], out_dir)
    print(f'{len(missing)} CUDA stand-ins in {out_dir}')


def build_stub(soname, versions, out_dir):
    """lib `soname` defining versions {version: {name: is_object}}."""
    base = os.path.join(out_dir, soname)
    with open(base + '.c', 'w') as f:
        for names in versions.values():
            for name, is_object in sorted(names.items()):
                f.write(f'char {name}[64];\n' if is_object else
                        f'int {name}(void) {{ return 100; }}\n')
    with open(base + '.map', 'w') as f:
        for version, names in versions.items():
            listed = ''.join(f' {n};' for n in sorted(names))
            f.write(f'{version} {{ global:{listed} }};\n' if names else
                    f'{version} {{ }};\n')
    script = [f'-Wl,--version-script={base}.map'] if versions else []
    subprocess.run([CC, '-shared', '-fPIC', '-w', f'-Wl,-soname,{soname}',
                    *script, '-o', base, base + '.c'], check=True)


if __name__ == '__main__':
    main(*sys.argv[1:4])
