//! A copy of the agent's eBPF object whose maps are not pinned, so preflight can put
//! every program through the verifier without touching bpffs (a running agent's
//! pins stay as they are, and nothing is left behind).
//!
//! aya's loader pins every map declared `pinned` and has no switch to turn that
//! off, so the copy clears the `pinning` field of each legacy map definition
//! (`bpf_map_def`, 28 bytes each, in the ELF section `maps`).

/// Size of one legacy `bpf_map_def`: type, key size, value size, max entries,
/// flags, id, pinning (seven u32).
const MAP_DEF_SIZE: usize = 28;
/// Offset of `pinning` inside it.
const PINNING_OFFSET: usize = 24;
/// Executable section (`SHF_EXECINSTR`).
const SHF_EXECINSTR: u64 = 0x4;

/// Why the object could not be read or rewritten.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the embedded eBPF object is not as expected: {0}")]
pub struct ObjectError(String);

/// One ELF section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Section {
    /// Its name.
    pub name: String,
    /// `sh_flags`.
    pub flags: u64,
    /// Offset of its bytes in the file.
    pub offset: usize,
    /// Its size in bytes.
    pub size: usize,
}

impl Section {
    /// Whether it holds instructions.
    #[must_use]
    pub fn is_code(&self) -> bool {
        self.flags & SHF_EXECINSTR != 0
    }
}

fn read<const N: usize>(data: &[u8], at: usize) -> Result<[u8; N], ObjectError> {
    data.get(at..at + N)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| ObjectError(format!("truncated at byte {at}")))
}

fn u16_at(data: &[u8], at: usize) -> Result<usize, ObjectError> {
    Ok(u16::from_le_bytes(read(data, at)?).into())
}

fn u32_at(data: &[u8], at: usize) -> Result<u32, ObjectError> {
    Ok(u32::from_le_bytes(read(data, at)?))
}

fn u64_at(data: &[u8], at: usize) -> Result<usize, ObjectError> {
    usize::try_from(u64::from_le_bytes(read(data, at)?))
        .map_err(|_| ObjectError(format!("offset at byte {at} out of range")))
}

/// The sections of a little-endian ELF64 file (what bpf-linker writes for bpfel).
pub fn sections(data: &[u8]) -> Result<Vec<Section>, ObjectError> {
    if data.get(..4) != Some(b"\x7fELF") || data.get(4) != Some(&2) || data.get(5) != Some(&1) {
        return Err(ObjectError("not a little-endian ELF64 file".into()));
    }
    let shoff = u64_at(data, 0x28)?;
    let shentsize = u16_at(data, 0x3a)?;
    let shnum = u16_at(data, 0x3c)?;
    let shstrndx = u16_at(data, 0x3e)?;
    if shentsize < 0x40 || shstrndx >= shnum {
        return Err(ObjectError("bad section header table".into()));
    }
    let header = |i: usize| shoff + i * shentsize;
    let names_at = u64_at(data, header(shstrndx) + 0x18)?;
    let mut out = Vec::with_capacity(shnum);
    for i in 0..shnum {
        let h = header(i);
        let name_at = names_at + u32_at(data, h)? as usize;
        let name = data
            .get(name_at..)
            .and_then(|rest| rest.split(|b| *b == 0).next())
            .ok_or_else(|| ObjectError(format!("section {i}: name out of range")))?;
        let section = Section {
            name: String::from_utf8_lossy(name).into_owned(),
            flags: u64::from_le_bytes(read(data, h + 0x08)?),
            offset: u64_at(data, h + 0x18)?,
            size: u64_at(data, h + 0x20)?,
        };
        if section
            .offset
            .checked_add(section.size)
            .is_none_or(|end| end > data.len())
            && u32_at(data, h + 4)? != 8
        {
            // Only SHT_NOBITS (8) may point past the file.
            return Err(ObjectError(format!(
                "section {} out of range",
                section.name
            )));
        }
        out.push(section);
    }
    Ok(out)
}

/// The object's bytes, 8-byte aligned as aya requires.
pub struct AlignedObject {
    words: Vec<u64>,
    len: usize,
}

impl AlignedObject {
    fn copy(data: &[u8]) -> Self {
        let mut words = vec![0u64; data.len().div_ceil(8)];
        for (word, chunk) in words.iter_mut().zip(data.chunks(8)) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            *word = u64::from_ne_bytes(b);
        }
        Self {
            words,
            len: data.len(),
        }
    }

    /// The bytes.
    #[must_use]
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `words` owns at least `len` initialised bytes; u8 has no alignment.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast::<u8>(), self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, and the borrow is unique.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast::<u8>(), self.len) }
    }
}

/// A copy of `object` with every map's pinning cleared (`PinningType::None`).
pub fn without_pins(object: &[u8]) -> Result<AlignedObject, ObjectError> {
    let maps = sections(object)?.into_iter().find(|s| s.name == "maps");
    let mut copy = AlignedObject::copy(object);
    let Some(maps) = maps else {
        return Ok(copy);
    };
    if maps.size % MAP_DEF_SIZE != 0 {
        return Err(ObjectError(format!(
            "section maps is {} bytes, not a multiple of {MAP_DEF_SIZE}",
            maps.size
        )));
    }
    let bytes = copy.bytes_mut();
    for def in (maps.offset..maps.offset + maps.size).step_by(MAP_DEF_SIZE) {
        let at = def + PINNING_OFFSET;
        match u32_at(bytes, at)? {
            0 | 1 => bytes[at..at + 4].copy_from_slice(&0u32.to_le_bytes()),
            other => {
                return Err(ObjectError(format!(
                    "map definition at byte {def} has pinning {other}"
                )));
            }
        }
    }
    Ok(copy)
}

#[cfg(test)]
mod tests;
