// CRC-32C (Castagnoli, polynomial 0x1EDC6F41 reflected = 0x82F63B78), the checksum of iSCSI, ext4,
// TFRecord and many storage formats. crc32c(0, data, n) is the CRC of a whole buffer; a running CRC
// continues with crc32c(previous, more, m), so a stream's checksum is computed while it is written.
// Check value: crc32c(0, "123456789", 9) == 0xE3069283. x86-64 CPUs with SSE4.2 use the crc32
// instruction (several GB/s); elsewhere a slicing-by-8 table.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace mf::io {

uint32_t crc32c(uint32_t crc, const void* data, size_t nbytes);

// "crc32c:xxxxxxxx", the spelling stored in files.
std::string crc32c_string(uint32_t crc);

}  // namespace mf::io
